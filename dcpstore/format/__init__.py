"""What the bytes of a checkpoint mean, the same for every writer and reader.

Nothing here writes; modules here parse and validate what storage holds
(the integrity manifest, ``.metadata``, the in-flight marker) without ever
executing checkpoint content.
"""
