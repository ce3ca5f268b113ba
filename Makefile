# mesh-provisioner: the two commands a newcomer runs are `make run` and `make test`.
GO ?= go
BIN := bin/mesh-provisioner

.PHONY: build run test test-short vet fmt bench bench-quick chaos fuzz clean

build:
	$(GO) build -o $(BIN) ./cmd/mesh-provisioner

# The main job: the seat on an embedded NATS server, with a synthetic demo mesh loaded, and its
# metrics, /healthz and /readyz on 127.0.0.1:9464.
run: build
	./$(BIN) serve --demo --metrics-addr 127.0.0.1:9464

# Every test, against real in-process nats-servers and real Pebble stores.
test: vet
	$(GO) test -count=1 -timeout 270s ./...

vet:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
		if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

clean:
	rm -rf bin data

# Benchmarks: one table, every figure measured in the same run (docs/benchmarks.md keeps the last one).
bench: build
	$(GO) run ./cmd/bench -keys 1000000 -bin $(BIN) -out docs/benchmarks.md

bench-quick: build
	$(GO) run ./cmd/bench -keys 100000 -lookups 200 -bin $(BIN)
