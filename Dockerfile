# syntax=docker/dockerfile:1
#
# Multi-stage build of the `lease-router` binary (package `lease-router-cli`, in cli/).
#   docker build -t lease-router .
#   docker run --rm lease-router --help
#   docker compose up        (see docker-compose.yml)

FROM rust:1-bookworm AS builder
WORKDIR /src
COPY . .
# The cargo registry and the target directory are cache mounts (BuildKit), so a rebuild after
# a source edit does not download or compile the dependencies again; the binary is copied out
# of the cache in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p lease-router-cli --bin lease-router \
    && cp target/release/lease-router /usr/local/bin/lease-router

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 lease-router \
    && useradd --system --uid 10001 --gid lease-router --no-create-home \
       --shell /usr/sbin/nologin lease-router
COPY --from=builder /usr/local/bin/lease-router /usr/local/bin/lease-router
USER 10001:10001
ENV RUST_LOG=info
# glibc backs the heap with transparent huge pages (where the host's THP mode is `madvise`,
# Debian's default): a large prefix index is read at random, and with 4 KiB pages a lookup can
# wait on a page-table walk or fault; with 2 MiB pages the index's p99 lookup fell from ~150
# to ~5 µs for 2 bytes more per lease (deploy/README.md, "Huge pages").
ENV GLIBC_TUNABLES=glibc.malloc.hugetlb=1
EXPOSE 9464
ENTRYPOINT ["/usr/local/bin/lease-router"]
CMD ["serve", "--http-addr", "0.0.0.0:9464"]
