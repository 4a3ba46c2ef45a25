"""What the bytes mean: the on-storage format, the same for every writer.

Owns the checkpoint layout and file names (:mod:`.layout`), the integrity
manifest's schema and the shared validation of a commit (:mod:`.manifest`),
the restricted unpicklers for ``.metadata`` and non-tensor items
(:mod:`.safe_pickle`), a running save's proof of life for ``gc``
(:mod:`dcpstore._impl.dcp.liveness.alive_file`), the CRC32C arithmetic (:mod:`.checksum`), the tensor
record codec (:mod:`.record`) and what a record must be before anything
trusts it (:mod:`.record_zip`), whether chunks tile a tensor
(:mod:`.chunks`), and bit-exact tensor copies for every dtype
(:mod:`.bitcopy`). Nothing here talks to DCP's protocol or decides when
anything is written: the DCP writer and reader (:mod:`dcpstore._impl.dcp`) and the
maintenance commands use these definitions. What is read from storage is
parsed and validated here without ever executing checkpoint content.
"""
