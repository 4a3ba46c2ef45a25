"""The native S3 backend: the storage (:mod:`.storage`), its botocore client
(:mod:`.client`), multipart uploads (:mod:`.upload`), the one table of S3
error codes (:mod:`.error_codes`) and the AWS environment a client reads
(:mod:`.aws_env`)."""
