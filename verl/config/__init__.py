"""The trainer's configuration: schema (dataclasses with help), loading and checks, keys of other
trainers (compatibility tables), derived batch sizes, and the generated YAML."""
