"""An example hpref plugin; the hook implementations live in `hpref_example.plugin`."""
