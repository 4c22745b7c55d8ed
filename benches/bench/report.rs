//! The report: each case's rows, printed as they are measured and then written as one Markdown
//! table; and the statistics the rows show: medians, percentiles, and ratios of runs paired
//! within a repetition.

use std::fmt::Write as _;

pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// The median of the ratios `a[i] / b[i]` of runs made in the same repetition, next to each
/// other: steadier on a shared machine than the ratio of the two medians, which may come from
/// runs minutes apart.
pub(crate) fn paired_ratio(a: &[f64], b: &[f64]) -> f64 {
    median(pair_ratios(a, b))
}

/// The ratios `a[i] / b[i]` of runs made in the same repetition.
fn pair_ratios(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, b)| a / b).collect()
}

/// [`pair_ratios`], lowest first.
fn sorted_pair_ratios(a: &[f64], b: &[f64]) -> Vec<f64> {
    let mut ratios = pair_ratios(a, b);
    ratios.sort_by(|x, y| x.total_cmp(y));
    ratios
}

/// The median of the paired ratios with their interquartile range and count, as the ratio
/// column shows a targeted write case.
pub(crate) fn paired_ratio_spread(a: &[f64], b: &[f64]) -> String {
    let ratios = sorted_pair_ratios(a, b);
    format!(
        "{:.3} (middle half of the pairs {:.3} to {:.3}; {} pairs)",
        median(ratios.clone()),
        percentile(&ratios, 0.25),
        percentile(&ratios, 0.75),
        ratios.len()
    )
}

/// The median of the paired ratios followed by every pair's, lowest first: for the relay cases,
/// whose few pairs move by a tenth from one to the next on this machine.
pub(crate) fn paired_ratio_each(a: &[f64], b: &[f64]) -> String {
    let ratios = sorted_pair_ratios(a, b);
    let each: Vec<String> = ratios.iter().map(|r| format!("{r:.3}")).collect();
    format!(
        "{:.3} (the {} pairs: {})",
        median(ratios.clone()),
        ratios.len(),
        each.join(", ")
    )
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

pub(crate) struct Report {
    pub(crate) rows: Vec<[String; 5]>,
    /// The figures the charts draw (see `charts.rs`).
    pub(crate) bars: Vec<crate::charts::Bar>,
}

impl Report {
    pub(crate) fn row(
        &mut self,
        case: &str,
        figure: String,
        baseline: String,
        ratio: String,
        target: &str,
    ) {
        println!("  {case}: {figure} | baseline {baseline} | {ratio} | {target}");
        self.rows
            .push([case.into(), figure, baseline, ratio, target.into()]);
    }

    /// A figure for a chart: `value` of `series` in `group` of `chart`.
    pub(crate) fn bar(&mut self, chart: &'static str, group: &str, series: &str, value: f64) {
        self.bars.push(crate::charts::Bar {
            chart,
            group: group.into(),
            series: series.into(),
            value,
        });
    }

    pub(crate) fn markdown(&self) -> String {
        let mut out = String::from(
            "| case | figure | baseline | ratio | target |\n| --- | --- | --- | --- | --- |\n",
        );
        for r in &self.rows {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} |",
                r[0], r[1], r[2], r[3], r[4]
            );
        }
        out
    }
}
