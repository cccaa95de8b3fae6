"""TEI's gRPC API (tei.v1): the proto, its generated modules (committed, no codegen at run time) and the server."""
