//! The charts `make bench` draws into `docs/bench/`: grouped bar charts, as SVG, of the figures
//! the cases hand to [`Report::bar`](crate::report::Report::bar). Written by hand so that they
//! need nothing beyond the standard library. A chart none of whose cases ran keeps its last
//! drawing.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// One bar: a figure of `series` in `group` of the chart `chart`.
pub(crate) struct Bar {
    pub(crate) chart: &'static str,
    pub(crate) group: String,
    pub(crate) series: String,
    pub(crate) value: f64,
}

/// The charts: file name, title, and what the values are.
const CHARTS: [(&str, &str, &str); 2] = [
    (
        "latency",
        "Latency from the statement's start to an XREAD reader, 4 pgbench clients",
        "ms",
    ),
    (
        "drain",
        "Drain rate of a 200,000-event backlog (200 keys and 100,000 events for the workers)",
        "events/s",
    ),
];

const COLOURS: [&str; 4] = ["#4e79a7", "#f28e2b", "#59a14f", "#9c755f"];

/// Writes each chart that has bars into `dir`; returns the files written.
pub(crate) fn draw(bars: &[Bar], dir: &Path) -> Vec<String> {
    let mut written = Vec::new();
    for (name, title, unit) in CHARTS {
        let mine: Vec<&Bar> = bars.iter().filter(|b| b.chart == name).collect();
        if mine.is_empty() {
            continue;
        }
        let path = dir.join(format!("{name}.svg"));
        if std::fs::create_dir_all(dir).is_ok()
            && std::fs::write(&path, svg(title, unit, &mine)).is_ok()
        {
            written.push(path.display().to_string());
        }
    }
    written
}

/// A round step for about five ticks up to `top`.
fn tick_step(top: f64) -> f64 {
    let rough = (top / 5.0).max(f64::MIN_POSITIVE);
    let magnitude = 10f64.powf(rough.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|step| *step >= rough)
        .unwrap_or(10.0 * magnitude)
}

fn label(value: f64) -> String {
    if value == 0.0 {
        "0".into()
    } else if value >= 1000.0 {
        format!("{value:.0}")
    } else if value >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Where `item` is in `list`, appended if it is not there yet.
fn index_of<'a>(list: &mut Vec<&'a str>, item: &'a str) -> usize {
    list.iter().position(|x| *x == item).unwrap_or_else(|| {
        list.push(item);
        list.len() - 1
    })
}

/// A grouped bar chart: groups in the order of their first bar, series likewise.
fn svg(title: &str, unit: &str, bars: &[&Bar]) -> String {
    let mut groups: Vec<&str> = Vec::new();
    let mut series: Vec<&str> = Vec::new();
    let mut values: BTreeMap<(usize, usize), f64> = BTreeMap::new();
    for bar in bars {
        let g = index_of(&mut groups, &bar.group);
        let s = index_of(&mut series, &bar.series);
        values.insert((g, s), bar.value);
    }
    let (width, height) = (900.0, 420.0);
    let (left, right, top, bottom) = (80.0, 20.0, 60.0, 70.0);
    let plot_w = width - left - right;
    let plot_h = height - top - bottom;
    let max = values.values().copied().fold(0.0, f64::max);
    let step = tick_step(max * 1.1);
    let y_top = (max * 1.1 / step).ceil() * step;
    let y = |v: f64| top + plot_h * (1.0 - v / y_top);
    let mut out = String::new();
    let _ = write!(
        out,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>
"##,
        width / 2.0,
        escape(title)
    );
    let mut tick = 0.0;
    while tick <= y_top + step / 2.0 {
        let _ = writeln!(
            out,
            r##"<line x1="{left}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            width - right,
            left - 6.0,
            y(tick) + 4.0,
            label(tick),
            y = y(tick)
        );
        tick += step;
    }
    let _ = writeln!(
        out,
        r##"<text x="18" y="{}" transform="rotate(-90 18 {})" text-anchor="middle">{unit}</text>"##,
        top + plot_h / 2.0,
        top + plot_h / 2.0
    );
    let group_w = plot_w / groups.len() as f64;
    let bar_w = (group_w * 0.8 / series.len() as f64).min(60.0);
    for (g, group) in groups.iter().enumerate() {
        let start = left + g as f64 * group_w + (group_w - bar_w * series.len() as f64) / 2.0;
        for s in 0..series.len() {
            let Some(&value) = values.get(&(g, s)) else {
                continue;
            };
            let x = start + s as f64 * bar_w;
            let _ = writeln!(
                out,
                r##"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"/><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{}</text>"##,
                y(value),
                bar_w - 2.0,
                top + plot_h - y(value),
                COLOURS[s % COLOURS.len()],
                x + bar_w / 2.0 - 1.0,
                y(value) - 4.0,
                label(value)
            );
        }
        let _ = writeln!(
            out,
            r##"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"##,
            left + (g as f64 + 0.5) * group_w,
            top + plot_h + 20.0,
            escape(group)
        );
    }
    let _ = writeln!(
        out,
        r##"<line x1="{left}" x2="{}" y1="{}" y2="{}" stroke="#333"/>"##,
        width - right,
        top + plot_h,
        top + plot_h
    );
    for (s, name) in series.iter().enumerate() {
        let x = left + s as f64 * 200.0;
        let y = height - 22.0;
        let _ = writeln!(
            out,
            r##"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{y}">{}</text>"##,
            y - 10.0,
            COLOURS[s % COLOURS.len()],
            x + 18.0,
            escape(name)
        );
    }
    out.push_str("</svg>\n");
    out
}
