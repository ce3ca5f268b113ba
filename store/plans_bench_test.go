package store_test

import (
	"fmt"
	"testing"

	provisioner "github.com/novox/mesh-provisioner"
	"github.com/novox/mesh-provisioner/store"
)

// BenchmarkPlans_1000x20 measures what one change costs in a mesh of 1,000 nodes × 20 modules (20,000
// plan rows; each node's bucket holds three builds of each module, the newest refused): the time of
// one Apply of one message, and how many plan rows it recomputed.
//
//	go test ./store -run '^$' -bench Plans_1000x20 -benchtime 2000x
func BenchmarkPlans_1000x20(b *testing.B) {
	const nodes, modules = 1000, 20
	db, err := store.Open(b.TempDir(), store.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	node := func(n int) string { return fmt.Sprintf("n%04d", n) }
	module := func(m int) string { return fmt.Sprintf("mod-%02d", m) }
	seqs := map[string]uint64{}
	apply := func(tb testing.TB, bucket string, msgs ...provisioner.Message) {
		for i := range msgs {
			seqs[bucket]++
			msgs[i].Seq = seqs[bucket]
			msgs[i].Time = int64(seqs[bucket]) * 1e9
		}
		if err := db.Apply(bucket, msgs, 1, false); err != nil {
			tb.Fatal(err)
		}
	}
	comp := func(tb testing.TB, key, status string, plan any) provisioner.Message {
		return provisioner.Message{Key: key, Op: provisioner.OpPut, Value: mpk(tb, map[string]any{"status": status, "plan": plan})}
	}
	for n := 0; n < nodes; n++ {
		var msgs []provisioner.Message
		for m := 0; m < modules; m++ {
			for _, c := range []struct {
				build  int
				status string
			}{{100, "published"}, {101, "published"}, {102, "refused"}} {
				msgs = append(msgs, comp(b, fmt.Sprintf("%s.%d", module(m), c.build), c.status,
					map[string]any{"image": fmt.Sprintf("%s:%d", module(m), c.build), "node": node(n)}))
			}
		}
		apply(b, provisioner.ComposedPrefix+node(n), msgs...)
	}
	var host []provisioner.Message
	for n := 0; n < nodes; n++ {
		for m := 0; m < modules; m++ {
			host = append(host, provisioner.Message{Key: node(n) + "." + module(m), Op: provisioner.OpPut, Value: mpk(b, map[string]any{"want": 101, "have": 100})})
		}
		if len(host) >= 4000 {
			apply(b, provisioner.BucketHostModules, host...)
			host = host[:0]
		}
	}
	apply(b, provisioner.BucketHostModules, host...)
	for m := 0; m < modules; m++ {
		apply(b, provisioner.BucketIndexerBuilds, provisioner.Message{Key: module(m), Op: provisioner.OpPut, Value: mpk(b, map[string]any{"newest": 102})})
	}

	run := func(b *testing.B, change func(b *testing.B, i int)) {
		before := db.PlanStats().RowsRecomputed
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			change(b, i)
		}
		b.StopTimer()
		b.ReportMetric(float64(db.PlanStats().RowsRecomputed-before)/float64(b.N), "rows/change")
	}
	b.Run("one composition", func(b *testing.B) {
		run(b, func(b *testing.B, i int) {
			n, m := (i*7919)%nodes, i%modules
			apply(b, provisioner.ComposedPrefix+node(n), comp(b, fmt.Sprintf("%s.%d", module(m), 103+i), "published", i))
		})
	})
	b.Run("one refusal held at the last plan kept", func(b *testing.B) {
		run(b, func(b *testing.B, i int) {
			n, m := (i*7919)%nodes, i%modules
			apply(b, provisioner.ComposedPrefix+node(n), comp(b, fmt.Sprintf("%s.101", module(m)), "refused", nil))
		})
	})
	b.Run("one want", func(b *testing.B) {
		run(b, func(b *testing.B, i int) {
			n, m := (i*7919)%nodes, i%modules
			apply(b, provisioner.BucketHostModules, provisioner.Message{Key: node(n) + "." + module(m), Op: provisioner.OpPut, Value: mpk(b, map[string]any{"want": 100 + i%3, "have": 100})})
		})
	})
	b.Run("one newest build", func(b *testing.B) {
		run(b, func(b *testing.B, i int) {
			apply(b, provisioner.BucketIndexerBuilds, provisioner.Message{Key: module(i % modules), Op: provisioner.OpPut, Value: mpk(b, map[string]any{"newest": 102 + i%2})})
		})
	})
}
