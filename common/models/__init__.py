"""The architectures a federation trains, their flat parameter layout, and pretrained adapters."""
