"""The config: the keys' vocabulary (keys.py; base.yml holds each default and its meaning), layered YAML
and key=value loaded (load.py) and checked (validate.py), then resolved for the devices (resolve.py: the
platform defaults' choices, the mesh shape and every derived value, declared and frozen).

A new key: one line in configs/base.yml with its default and comment; a check in validate.py (or in
resolve.py when it depends on the devices).
"""
