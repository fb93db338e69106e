"""Small helpers every layer may use: lazy package exports, keyword checking, optional dependencies. Nothing here
imports torch, Lightning or another part of the library."""
