"""The package version, in a module of its own: a module that records it (a checkpoint's
manifest, ``hpctrain doctor``) imports this leaf, not the package with its exports."""

__version__ = "0.1.0"
