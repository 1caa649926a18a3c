"""The built-in engines that need no model: ``sample`` (tokens) and ``sample-diffusion``
(images), for trying the gateway and testing it."""
