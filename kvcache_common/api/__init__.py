"""Generated protobuf / gRPC stubs of proto/ (run scripts/gen_protos.sh; do not edit)."""
