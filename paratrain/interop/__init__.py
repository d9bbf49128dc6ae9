"""Other libraries' formats: Hugging Face Llama directories, imported (`hf`) and exported (`export`)."""
