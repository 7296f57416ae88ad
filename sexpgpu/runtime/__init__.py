"""The shared runtime: device config, groups and collectives, memory budgets."""
