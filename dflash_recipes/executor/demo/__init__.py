"""The embedded tiny default and the `demo` command."""
