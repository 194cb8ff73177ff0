"""Images in prompts: media loading and limits, the models' own processors, and the
features (pixel data, placeholder ranges, content hashes) that travel with a request."""
