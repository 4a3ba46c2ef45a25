"""What the bytes mean: the on-storage format, the same for every writer.

Owns the checkpoint layout and file names (:mod:`.layout`), the integrity
manifest, the CRC32C arithmetic (:mod:`.checksum`), the tensor record
codec (:mod:`.record`) and bit-exact tensor copies for every dtype
(:mod:`.bitcopy`). Nothing here talks to DCP's protocol or decides when
anything is written: the DCP writer and reader (:mod:`dcpstore.dcp`) and the
maintenance commands use these definitions.

Layer: format. May import :mod:`dcpstore.errors`, the value objects and
:mod:`dcpstore.storage`; nothing above.
"""
