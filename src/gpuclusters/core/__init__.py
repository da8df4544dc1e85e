"""Pure domain code shared by every layer: enums, errors, public API models and
capacity logic. Nothing in here performs I/O."""
