"""FireRedTTS3 inference engine shared by all Triton models."""
