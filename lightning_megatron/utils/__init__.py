"""Small helpers every layer may use: lazy package exports, keyword checking, optional dependencies, and tensor views
(``tensors``, the one module here that imports torch: loaded only where it is used). Nothing here imports Lightning or
another part of the library."""
