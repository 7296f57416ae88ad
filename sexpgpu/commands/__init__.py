"""The CLI's subcommands, one module each (see `sexpgpu.cli`)."""
