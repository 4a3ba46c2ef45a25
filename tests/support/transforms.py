"""DCP stream transforms for the tests (``_extensions`` /
``_extension_registry``): :class:`Xor` changes every byte, so a reader that
skips it reads garbage; :class:`Inflate` decodes any item to endless bytes
(a decompression bomb); :func:`registry` registers them for a reader.
"""

from __future__ import annotations

import io
from typing import IO, Any, cast

from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

_XOR = bytes(b ^ 0x5A for b in range(256))


class Xor(StreamTransformExtension):
    """A stream transform that changes every byte (so a reader that skips
    it reads garbage), fast enough for MiB-sized tensors."""

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> Xor:
        return Xor()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                data = bytes(b)
                output.write(data.translate(_XOR))
                return len(data)

            def close(self) -> None:
                output.close()
                super().close()

        return cast(IO[bytes], Writer())

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(input.read().translate(_XOR))


class Inflate(Xor):
    """Decodes any item to endless bytes: a decompression bomb."""

    @staticmethod
    def registry_name() -> str:
        return "test.xor"  # what the checkpoint names

    @staticmethod
    def from_descriptor(version: str) -> Inflate:
        return Inflate()

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        class Endless(io.RawIOBase):
            def readable(self) -> bool:
                return True

            def readinto(self, b: Any) -> int:
                view = memoryview(b)
                view[:] = b"\0" * len(view)
                return len(view)

        return cast(IO[bytes], Endless())


def registry(*classes: type[StreamTransformExtension]) -> ExtensionRegistry:
    reg = ExtensionRegistry()
    for cls in classes:
        reg.register(cls)
    return reg
