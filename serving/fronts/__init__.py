"""What a stranger reaches first: the bounded gRPC and HTTP fronts before Triton's own ports, their limits, and the metrics relay."""
