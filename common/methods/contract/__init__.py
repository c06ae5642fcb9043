"""The contracts every method implements: its spec, its server side and its client side.

Importing this package loads none of them: the registry imports the spec alone, without torch.
"""
