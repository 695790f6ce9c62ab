//! The commands' tables (`pools`, `dead list`, `config history`): a header row, then
//! one row a line, every column starting at the same place on every line.

/// How a column's values sit in its width: numbers right, text left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Align {
    Left,
    Right,
}

/// One column: its header and how its values sit.
pub(crate) type Column = (&'static str, Align);

/// The table (pure): `columns`' headers, then `rows`, each column as wide as its widest
/// value, two spaces between columns. The last column is not padded, so no line ends in
/// spaces; a line break in a value becomes a space, so a row stays one line.
pub(crate) fn render<const N: usize>(columns: [Column; N], rows: &[[String; N]]) -> String {
    let header = columns.map(|(name, _)| name.to_owned());
    let rows: Vec<[String; N]> = std::iter::once(header)
        .chain(
            rows.iter()
                .map(|row| row.clone().map(|v| v.replace('\n', " "))),
        )
        .collect();
    let widths: [usize; N] = std::array::from_fn(|column| {
        rows.iter()
            .map(|row| row[column].chars().count())
            .max()
            .unwrap_or(0)
    });
    let mut text = String::new();
    for row in &rows {
        let mut line = String::new();
        for (column, value) in row.iter().enumerate() {
            let pad = " ".repeat(widths[column] - value.chars().count());
            if column > 0 {
                line.push_str("  ");
            }
            match columns[column].1 {
                Align::Right => {
                    line.push_str(&pad);
                    line.push_str(value);
                }
                Align::Left if column + 1 == N => line.push_str(value),
                Align::Left => {
                    line.push_str(value);
                    line.push_str(&pad);
                }
            }
        }
        text.push_str(line.trim_end());
        text.push('\n');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(values: [&str; 3]) -> [String; 3] {
        values.map(str::to_owned)
    }

    #[test]
    fn every_column_starts_at_the_same_place_on_every_line() {
        let table = render(
            [
                ("SEQ", Align::Right),
                ("POOL", Align::Left),
                ("MESSAGE", Align::Left),
            ],
            &[
                row(["1", "a-long-pool-name", "first"]),
                row(["1234567", "b", "second\nline"]),
            ],
        );
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines,
            [
                "    SEQ  POOL              MESSAGE",
                "      1  a-long-pool-name  first",
                "1234567  b                 second line",
            ]
        );
    }

    #[test]
    fn no_line_ends_in_spaces_and_no_rows_is_a_header() {
        let table = render(
            [
                ("POOL", Align::Left),
                ("NOTE", Align::Left),
                ("N", Align::Left),
            ],
            &[row(["x", "", ""])],
        );
        assert_eq!(table, "POOL  NOTE  N\nx\n");
        assert_eq!(render([("A", Align::Left)], &[]), "A\n");
    }
}
