"""A request -> its prompt tokens: the prompt builder, chat templates, fill in the middle."""
