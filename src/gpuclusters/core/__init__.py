"""Domain code shared by every layer: enums, errors, public API models and
capacity logic, all pure. The one exception is ``clientconfig``, the format
of the CLI's config file, which the server writes and the client reads."""
