"""Constrained decoding: a request's output held to a JSON schema, a regular expression, a Lark grammar or
a list of choices, by masking the tokens its grammar cannot take next (llguidance computes the masks)."""
