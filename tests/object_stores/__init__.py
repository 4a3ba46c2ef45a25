"""Object-store specifics on a real (moto) S3 endpoint: multipart and
ranged requests, the connection budget, lent parts, errors and faulty
networks, and secrets never leaking."""
