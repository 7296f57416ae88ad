"""The experiment language: reader, forms, variants, checker."""
