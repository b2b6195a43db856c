"""Generated gRPC/protobuf code for specdec.v1. Do not edit: run scripts/gen_proto.py."""
