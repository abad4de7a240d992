"""File formats shared by the adapters: traces, embedded traces, profiles, configuration fields.

Every reader reports bad input as `errors.InputError` naming the file, line or field.
"""
