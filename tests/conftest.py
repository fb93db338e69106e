"""Test hygiene: a test that runs a Trainer inside the pytest process (world size 1) leaves the default process
group and Lightning's MASTER_ADDR/MASTER_PORT/... environment behind; later tests would then see a process group
they did not start, and subprocesses would inherit a port that is still bound. Undo both after each test."""
import os

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    env = dict(os.environ)
    started_before = dist.is_available() and dist.is_initialized()
    yield
    if not started_before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)


def pytest_addoption(parser):
    parser.addoption("--mutations", action="store_true",
                     help="run the tests marked 'mutations' (tests/test_mutations.py: plants bugs in a copy of the "
                          "tree and runs test selections against each; minutes)")


def pytest_configure(config):
    config.addinivalue_line("markers", "mutations: the mutation check (minutes); skipped unless --mutations")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--mutations"):
        return
    skip = pytest.mark.skip(reason="minutes long: run with --mutations, or python tests/mutations.py")
    for item in items:
        if item.get_closest_marker("mutations") is not None:
            item.add_marker(skip)
