"""The gRPC edge: requests decoded, answers encoded, the socket and the metrics endpoint."""
