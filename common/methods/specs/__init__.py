"""What each method is before it runs: its name, its run-config keys and its rules across keys.

A spec imports neither torch nor any training code, so a run configuration is checked (``fibos local
-c``, ``fibos control submit``, the ServerApp's first step) in well under a second. Each method's
implementation (:mod:`common.methods`) subclasses its spec and is imported only when a run builds it
(:func:`common.methods.method_class`).

One module per method, named as its implementation's module. The groups of keys several methods
share are modules of their own: :mod:`~common.methods.specs.fisher` (the Fisher-ranked methods),
:mod:`~common.methods.specs.channels` (models with a channel graph),
:mod:`~common.methods.specs.privacy` and :mod:`~common.methods.specs.robust`.
"""
