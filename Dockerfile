# torus-wgpu in a container: the release binary and Mesa's Vulkan drivers (lavapipe for CPU-only
# nodes; RADV and ANV for AMD and Intel GPUs; NVIDIA GPUs use the driver's own Vulkan ICD, which
# the NVIDIA container toolkit mounts with NVIDIA_DRIVER_CAPABILITIES=compute,utility,graphics).
# Build: docker build -t torus-wgpu .   Run: docker run -p 8000:8000 -v $PWD/models:/models \
#   torus-wgpu serve --host 0.0.0.0 --model /models/SmolLM2-135M-Instruct.Q4_1.gguf
# Models are not in the image: mount them (scripts/fetch-model.sh fetches the test models).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --bin torus-wgpu && cp target/release/torus-wgpu /usr/local/bin/torus-wgpu

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends mesa-vulkan-drivers libvulkan1 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/torus-wgpu /usr/local/bin/torus-wgpu
COPY configs /etc/torus-wgpu/configs
ENV XDG_RUNTIME_DIR=/tmp
EXPOSE 8000
ENTRYPOINT ["torus-wgpu"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
