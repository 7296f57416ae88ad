"""Devices that run IR programs: cpu (the interpreter) and cuda."""
