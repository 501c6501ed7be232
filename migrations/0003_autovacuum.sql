-- Vacuum after a fixed number of dead row versions, not a fraction of the table.
--
-- Every lease leaves the picked rows' entries in jobs_pending_idx dead, at the
-- front of the index where the next lease starts its walk, and only VACUUM
-- removes them: each lease reads every dead leaf page in front of the live
-- entries (100k pending, after 90k leased: 609 index and heap buffers to pick
-- 256 jobs instead of 263). With the default scale factor (20 % of the table)
-- a table holding 10M done rows is vacuumed once per ~1M finished jobs, and
-- by then a lease walks thousands of dead pages. The history is all-visible,
-- so such a vacuum reads only the pages that changed since the last one (and
-- each index once): 0.09 s for 2M rows here.
ALTER TABLE gpuq.jobs SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);
