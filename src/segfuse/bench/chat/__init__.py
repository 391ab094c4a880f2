"""`segfuse bench chat`: chats and shared prompts with and without the prefix cache, and that cache's answers."""
