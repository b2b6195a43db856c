"""The gRPC edge shared by every role: protobuf <-> core dataclasses, error -> status, server bootstrap."""
