"""Configuration: base.yml's keys loaded, layered and validated (load), the platform defaults and
the config resolved for the devices (resolve)."""
