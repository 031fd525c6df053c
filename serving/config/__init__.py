"""What the server is told and each model reads: the launcher's options (ServeOptions), each model's options, and the model repository rendered from them."""
