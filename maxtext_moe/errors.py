"""Errors the CLI turns into one line on stderr and exit code 2."""


class UserError(ValueError):
  """Bad input from the user: a wrong key, recipe, value, layout or file. The message is one line."""
