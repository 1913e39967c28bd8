"""The inputs an operator writes: ``pins.toml`` (pins, with its lanes) and the fleet files in
``hosts/`` (hosts), read by one loader against their schemas."""
