"""The routes by family, each a class over the Service: OpenAI's, llama.cpp's, and the server's own."""
