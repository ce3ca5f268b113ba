package provisioner_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	provisioner "github.com/novox/mesh-provisioner"
)

func TestRollupMatches(t *testing.T) {
	for _, tc := range []struct {
		pattern, key string
		want         bool
	}{
		{"n1.m.k.*", "n1.m.k.a", true},
		{"n1.m.k.*", "n1.m.k", false},
		{"n1.m.k.*", "n1.m.k.a.b", false},
		{"n1.>", "n1.m", true},
		{"n1.>", "n1.m.k.a", true},
		{"n1.>", "n1", false},
		{"n1.>", "n10.m", false},
		{"*.m.>", "n1.m.k", true},
		{"*.m.>", "n1.x.k", false},
		{">", "a", true},
		{"*", "a", true},
		{"*", "a.b", false},
		{"n1.a*b", "n1.axb", false}, // not a wildcard token
		{"n1.m", "n1.m", true},
		// A > with tokens after it is no wildcard: the server's subject tree reads it as itself.
		{"n1.>.x", "n1.m.x", false},
		{"n1.>.x", "n1.m.k.x", false},
		{"n1.>.x", "n1.>.x", true},
		{">.x", "a.x", false},
		{"n1.*.>.x", "n1.m.>.x", true},
		{"n1.*.>.x", "n1.m.k.x", false},
	} {
		require.Equal(t, tc.want, provisioner.RollupMatches(tc.pattern, tc.key), "%q %q", tc.pattern, tc.key)
	}
}

func TestMessage_RemovesOthers(t *testing.T) {
	for _, tc := range []struct {
		key    string
		rollup provisioner.Rollup
		want   bool
	}{
		{"n1.m.k.a", provisioner.RollupSub, false}, // a KV purge: its own key
		{"n1.m.k.*", provisioner.RollupSub, true},
		{"n1.>", provisioner.RollupSub, true},
		{"n1.a>b", provisioner.RollupSub, false},
		{"n1.>.x", provisioner.RollupSub, false}, // a literal: a purge of that subject alone
		{">.x", provisioner.RollupSub, false},
		{">", provisioner.RollupSub, true},
		{"n1.*.>.x", provisioner.RollupSub, true},
		{"n1.>", provisioner.RollupNone, false},
		{"n1.m.k.a", provisioner.RollupAll, true},
	} {
		m := provisioner.Message{Key: tc.key, Rollup: tc.rollup}
		require.Equal(t, tc.want, m.RemovesOthers(), "%q %v", tc.key, tc.rollup)
	}
	// On a subject added to the stream by hand: the whole stream's rollup removes every key; one of its
	// own subject, wildcards or not, none (a stream's subjects never overlap).
	for _, tc := range []struct {
		subject string
		rollup  provisioner.Rollup
		want    bool
	}{
		{"extra.x", provisioner.RollupAll, true},
		{"extra.x", provisioner.RollupSub, false},
		{"extra.*", provisioner.RollupSub, false},
		{"extra.>", provisioner.RollupSub, false},
		{"extra.>", provisioner.RollupNone, false},
	} {
		m := provisioner.Message{Key: tc.subject, Rollup: tc.rollup, Foreign: true}
		require.Equal(t, tc.want, m.RemovesOthers(), "foreign %q %v", tc.subject, tc.rollup)
	}
	// The server reads the header's value without regard to case.
	for v, want := range map[string]provisioner.Rollup{"sub": provisioner.RollupSub, "SUB": provisioner.RollupSub, "All": provisioner.RollupAll, "": provisioner.RollupNone, "x": provisioner.RollupNone} {
		require.Equal(t, want, provisioner.RollupOfHeaders(map[string][]string{"Nats-Rollup": {v}}), v)
	}
}
