"""One module per backend: :mod:`.local` (POSIX), :mod:`.s3` (native S3 over
botocore), :mod:`.msc` (NVIDIA Multi-Storage-Client) and :mod:`.fsspec`.
:mod:`dcpstore._impl.storage.backend_registry` imports each on first use."""
