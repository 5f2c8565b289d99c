"""The config: each key's default and meaning in configs/base.yml, the rest of its declaration (group, values or
range, checks, platform default) in one `Key` (schema.py; the keys of group G in groups/G.py, a model family's
own in its module); layered YAML and key=value loaded (load.py) and checked (schema.validate), then resolved for
the devices (resolve.py: each auto value's platform default, the mesh shape and every derived value, frozen).

A new key: its line in configs/base.yml (default and comment) and its `Key(...)` in its group's module.
"""
