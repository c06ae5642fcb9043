"""What each method is before it runs: its name, its run-config keys and its rules across keys.

A spec imports neither torch nor any training code, so a run configuration is checked (``fibos local
-c``, ``fibos control submit``, the ServerApp's first step) in well under a second. Each method's
implementation (:mod:`common.methods`) subclasses its spec and is imported only when a run builds it
(:func:`common.methods.method_class`).
"""
