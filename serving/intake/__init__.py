"""A request as it comes in: its inputs read off Triton's tensors, checked once, the model it asks for, and tts's text-in streams."""
