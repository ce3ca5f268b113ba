# mesh-provisioner: the two commands a newcomer runs are `make run` and `make test`.
GO ?= go
BIN := bin/mesh-provisioner

.PHONY: build run test test-short race vet fmt bench bench-quick chaos soak fuzz clean

build:
	$(GO) build -o $(BIN) ./cmd/mesh-provisioner

# The main job: the seat on an embedded NATS server, with a synthetic demo mesh loaded, and its
# metrics, /healthz and /readyz on 127.0.0.1:9464.
run: build
	./$(BIN) serve --demo --metrics-addr 127.0.0.1:9464

# Every test, against real in-process nats-servers and real Pebble stores.
test: vet
	$(GO) test -count=1 -timeout 270s ./...

# Every test under the race detector: about 8 minutes on 2 cores when the machine is quiet.
race:
	$(GO) test -race -count=1 -timeout 15m ./...

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

# The long reliability runs: 20 SIGKILLs in the crash loop, 100,000 updates under 8 clients, and the
# fault tests, against real nats-servers and the real binary (the short versions run in make test).
chaos:
	@log=$$(mktemp); MESH_CHAOS=1 $(GO) test -count=1 -v -timeout 30m ./reliability/ >$$log 2>&1; rc=$$?; \
		grep -E '^(--- |PASS|FAIL|ok)|restarts consistent|faults survived|requests|seed|restart [0-9]+:|at SIGTERM|updates written' $$log; \
		if [ $$rc -ne 0 ]; then echo "--- the end of the log:"; tail -n 150 $$log; fi; rm -f $$log; exit $$rc

# The soak: a seat with plans under churn (composed buckets created and deleted, keys put, deleted and
# expiring, clients asking) for SOAK_FOR, checking that goroutines, the projector's per-bucket
# entries, open files and the heap stay bounded (docs/reliability.md). Not part of make test.
SOAK_FOR ?= 3m
soak:
	MESH_SOAK=1 MESH_SOAK_FOR=$(SOAK_FOR) $(GO) test -count=1 -v -timeout 60m -run '^TestSoak' ./reliability/

# Fuzzing: each target explores for FUZZTIME (the corpus under testdata/fuzz/ is replayed by every
# `make test`; what a run finds goes there too, to be kept as a regression seed).
FUZZTIME ?= 15s
FUZZ_TARGETS := .:FuzzParseKey .:FuzzDecodeCollection ./query:FuzzDecodeRequest ./query:FuzzAnswer \
	./internal/mpk:FuzzSkip ./internal/mpk:FuzzAppendJSON

fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; name=$${t##*:}; \
		echo "== $$name ($$pkg, $(FUZZTIME))"; \
		out=$$($(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) $$pkg 2>&1) || { echo "$$out"; exit 1; }; \
		echo "$$out" | grep -E 'execs: [0-9]+' | tail -n 1; \
	done
