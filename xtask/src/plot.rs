//! Line charts as PNG files for the bench report, drawn with plotters' bitmap backend.
//!
//! Text is drawn with a subset of DejaVu Sans embedded in xtask (`assets/`, its license
//! beside it), so the plots need no system fonts on a fresh machine.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

/// One line of a chart: its legend and its points `(x, y)`.
pub(crate) struct Series {
    /// The legend.
    pub(crate) name: String,
    /// The points, in x order.
    pub(crate) points: Vec<(f64, f64)>,
}

/// A chart's titles and axes. The x axis is logarithmic (base 2: contexts and sizes).
pub(crate) struct Chart<'a> {
    /// The title above the plot.
    pub(crate) title: &'a str,
    /// The x axis' label.
    pub(crate) x_label: &'a str,
    /// The y axis' label.
    pub(crate) y_label: &'a str,
    /// Whether the y axis is logarithmic.
    pub(crate) log_y: bool,
    /// Whether the y axis starts at 0 (a linear axis only).
    pub(crate) y_from_zero: bool,
    /// Where the legend goes: a corner the lines leave empty.
    pub(crate) legend: SeriesLabelPosition,
}

const FONT_BYTES: &[u8] = include_bytes!("../assets/DejaVuSans-subset.ttf");
const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Draws `series` into a PNG at `path`. Series without points are left out; a chart without
/// any point is an error.
pub(crate) fn line_chart(path: &Path, chart: &Chart<'_>, series: &[Series]) -> Result<(), String> {
    static FONT: OnceLock<bool> = OnceLock::new();
    let registered =
        *FONT.get_or_init(|| register_font("sans-serif", FontStyle::Normal, FONT_BYTES).is_ok());
    if !registered {
        return Err("the embedded font does not parse".to_owned());
    }
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .collect();
    let bounds = |f: fn(&(f64, f64)) -> f64| {
        all.iter()
            .map(f)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            })
    };
    let (x0, x1) = bounds(|p| p.0);
    let (y0, y1) = bounds(|p| p.1);
    if all.is_empty() || !(x0 > 0.0 && x1.is_finite() && y1.is_finite()) {
        return Err(format!("{}: no positive points to plot", path.display()));
    }
    // Pad the ranges so points do not sit on the frame.
    let x = (x0 / 1.25..x1 * 1.25).log_scale().base(2.0);
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    if chart.log_y {
        let lo = y0.max(f64::MIN_POSITIVE);
        draw(&root, chart, series, x, (lo / 1.5..y1 * 1.5).log_scale()).map_err(|e| err(&e))?;
    } else {
        let lo = if chart.y_from_zero {
            0.0
        } else {
            y0 - 0.05 * (y1 - y0).max(1e-9)
        };
        let hi = y1 + 0.08 * (y1 - lo).max(1e-9);
        draw(&root, chart, series, x, lo..hi).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;
type DrawResult =
    Result<(), DrawingAreaErrorKind<<BitMapBackend<'static> as DrawingBackend>::ErrorType>>;

/// Draws the frame, the mesh, the lines and the legend on `root` with the given axes.
fn draw<X, Y>(root: &Area<'_>, chart: &Chart<'_>, series: &[Series], x: X, y: Y) -> DrawResult
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut c = ChartBuilder::on(root)
        .caption(chart.title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(x, y)?;
    c.configure_mesh()
        .x_desc(chart.x_label)
        .y_desc(chart.y_label)
        .x_label_formatter(&|v| tokens(*v))
        .y_label_formatter(&|v| number(*v))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()?;
    for (i, s) in series.iter().filter(|s| !s.points.is_empty()).enumerate() {
        let color = COLORS[i % COLORS.len()];
        c.draw_series(LineSeries::new(
            s.points.iter().copied(),
            color.stroke_width(2),
        ))?
        .label(s.name.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        c.draw_series(s.points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .position(chart.legend.clone())
        .draw()?;
    Ok(())
}

/// A token count as the axis shows it: 4096 → "4K".
fn tokens(v: f64) -> String {
    if v >= 1024.0 && (v / 1024.0).fract() < 1e-6 {
        format!("{}K", (v / 1024.0) as u64)
    } else {
        format!("{}", v.round() as u64)
    }
}

/// A y value with as many digits as its size needs, without trailing zeros.
fn number(v: f64) -> String {
    let digits = match v.abs() {
        a if a >= 100.0 => 0,
        a if a >= 10.0 => 1,
        a if a >= 1.0 => 2,
        _ => 3,
    };
    let s = format!("{v:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}
